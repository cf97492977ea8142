// The C++ side of tests/toolchain/test_tc_cpp_api.py: runs kgen's generated launch
// contracts (generated/kgen_launch.hpp) on the cases the test writes, with no GPU, no
// driver and no CUDA context, and prints each answer for the test to compare with the
// Python launcher's (kgen.runtime.bind).
//
//   contract_cases CASES   one case a line: <kernel> then tab-separated <field>=T:<d0>,<d1>..
//                          (an array of that shape; [@<hex address>]: where it starts,
//                          else 0x1000), <field>=I:<int>, <field>=F:<float>;
//                          prints one line a case: "OK gx gy gz bx by bz smem" or
//                          "ERR\t<code>\t<contract>\t<message>"
//   contract_cases --self  the hand-written checks below (the typed API, decode_plan)
#include "kgen_launch.hpp"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

static std::vector<std::string> split(const std::string &s, char sep) {
    std::vector<std::string> out;
    std::string cur;
    std::istringstream in(s);
    while (std::getline(in, cur, sep)) out.push_back(cur);
    return out;
}

static int run_cases(const char *path) {
    std::ifstream in(path);
    if (!in) {
        std::fprintf(stderr, "cannot read %s\n", path);
        return 2;
    }
    std::string line;
    while (std::getline(in, line)) {
        std::vector<std::string> parts = split(line, '\t');
        if (parts.empty()) continue;
        const kgen::KernelInfo *k = kgen::find_kernel(parts[0].c_str());
        if (!k) {
            std::printf("ERR\t%d\t\tunknown kernel %s\n", (int)kgen::KGEN_ERR_UNKNOWN,
                        parts[0].c_str());
            continue;
        }
        kgen::Args a;
        bool bad = false;
        for (std::size_t i = 1; i < parts.size(); ++i) {
            std::size_t eq = parts[i].find('=');
            std::string name = parts[i].substr(0, eq);
            std::string kind = parts[i].substr(eq + 1, 1);
            std::string value = parts[i].substr(eq + 3);
            int f = kgen::field_of(name.c_str());
            if (f < 0) {
                std::printf("ERR\t%d\t\tunknown field %s\n", (int)kgen::KGEN_ERR_UNKNOWN,
                            name.c_str());
                bad = true;
                break;
            }
            if (kind == "T") {
                kgen::Tensor t;
                t.ptr = 0x1000;  // never dereferenced: check() reads shapes and addresses
                std::size_t at = value.find('@');
                if (at != std::string::npos) {
                    t.ptr = (CUdeviceptr)std::strtoull(value.c_str() + at + 1, nullptr, 16);
                    value = value.substr(0, at);
                }
                t.ndim = 0;
                for (const std::string &d : split(value, ','))
                    if (!d.empty()) {
                        if (t.ndim < 4) t.shape[t.ndim] = std::strtoll(d.c_str(), nullptr, 10);
                        ++t.ndim;
                    }
                a.t[f] = t;
            } else if (kind == "I") {
                a.i[f] = std::strtoll(value.c_str(), nullptr, 10);
            } else {
                a.f[f] = std::strtod(value.c_str(), nullptr);
            }
        }
        if (bad) continue;
        kgen::Launch l;
        kgen::Result r = kgen::check(*k, a, &l);
        if (r)
            std::printf("OK %u %u %u %u %u %u %u\n", l.grid[0], l.grid[1], l.grid[2],
                        l.block[0], l.block[1], l.block[2], l.shared_bytes);
        else
            std::printf("ERR\t%d\t%s\t%s\n", r.code, r.contract.c_str(), r.message.c_str());
    }
    return 0;
}

static int failures = 0;
#define EXPECT(cond)                                                              \
    do {                                                                          \
        if (!(cond)) {                                                            \
            std::fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #cond); \
            ++failures;                                                           \
        }                                                                         \
    } while (0)

// The typed API of one kernel of each op, and the host decode plan.
static int self_test() {
    using kgen::Tensor;
    const CUdeviceptr p = 0x1000;
    {   // fc_attn_flash_prefill: q [n][n_head][hd], caches [n_head_kv][max_seq][hd]
        kgen::fc_attn_flash_prefill::args a;
        a.q = Tensor(p, {4, 8, 256});
        a.k_cache = Tensor(p, {2, 64, 256});
        a.v_cache = Tensor(p, {2, 64, 256});
        a.out = Tensor(p, {4, 8, 256});
        a.pos0 = 0;
        kgen::Launch l;
        kgen::Result r = kgen::fc_attn_flash_prefill::check(a, &l);
        EXPECT(r.ok());
        EXPECT(l.grid[0] == 4 && l.grid[1] == 2 && l.grid[2] == 1 && l.block[0] == 256);
        EXPECT(l.shared_bytes > 0);
        a.pos0 = 61;  // rows [0, 65) of a 64-row cache
        r = kgen::fc_attn_flash_prefill::check(a);
        EXPECT(r.code == kgen::KGEN_ERR_CONTRACT && r.contract == "no ring wrap");
        EXPECT(r.message.find("fc_attn_flash_prefill: ") == 0);
        EXPECT(r.message.find("[contract: no ring wrap]") != std::string::npos);
        // A refused launch is refused before the driver is touched (none here).
        r = kgen::fc_attn_flash_prefill::launch(a, nullptr);
        EXPECT(r.code == kgen::KGEN_ERR_CONTRACT && r.contract == "no ring wrap");
        a.pos0 = 0;
        a.scale = 1e300;
        r = kgen::fc_attn_flash_prefill::check(a);
        EXPECT(r.contract == "scale");
        EXPECT(r.message.find("scale = 1e+300 must be finite in float32 and > 0") !=
               std::string::npos);
        // q half a float off its boundary (a view into a byte buffer): refused, named
        a.scale = std::nullopt;
        a.q = Tensor(p + 2, {4, 8, 256});
        r = kgen::fc_attn_flash_prefill::launch(a, nullptr);
        EXPECT(r.code == kgen::KGEN_ERR_CONTRACT && r.contract == "alignment");
        EXPECT(r.message == "fc_attn_flash_prefill: q must start on a 4-byte boundary "
                            "(address 0x1002) [contract: alignment]");
        a.q = Tensor(p + 4, {4, 8, 256});  // on its element's boundary: checked
        EXPECT(kgen::fc_attn_flash_prefill::check(a).ok());
    }
    {   // the split decode, with the host plan
        kgen::DecodePlan plan;
        EXPECT(kgen::decode_plan(1000, 256, 16, &plan).ok());
        EXPECT(plan.n_splits == 4 && plan.split_len == 256);
        EXPECT(kgen::decode_plan(0, 256, 16, &plan).code == kgen::KGEN_ERR_CONTRACT);
        kgen::fc_attn_flash_decode::args a;
        a.q = Tensor(p, {8, 256});
        a.k_cache = Tensor(p, {2, 1024, 256});
        a.v_cache = Tensor(p, {2, 1024, 256});
        a.m_out = Tensor(p, {8 * 16});
        a.l_out = Tensor(p, {8 * 16});
        a.acc_out = Tensor(p, {8 * 16 * 256});
        EXPECT(kgen::decode_plan(1000, 256, 16, &plan).ok());
        a.seq_len = plan.seq_len;
        a.n_splits = plan.n_splits;
        a.split_len = plan.split_len;
        kgen::Launch l;
        EXPECT(kgen::fc_attn_flash_decode::check(a, &l).ok());
        EXPECT(l.grid[0] == 4 && l.grid[1] == 2);
        a.n_splits = 5;
        EXPECT(kgen::fc_attn_flash_decode::check(a).contract == "split plan");
    }
    {   // the combine: a missing argument is its own code
        kgen::Args a;
        kgen::Result r = kgen::check(*kgen::find_kernel("fc_attn_flash_decode_combine"), a);
        EXPECT(r.code == kgen::KGEN_ERR_MISSING);
    }
    EXPECT(kgen::find_kernel("no_such_kernel") == nullptr);
    EXPECT(kgen::kernel_count() > 0);
    if (failures) std::fprintf(stderr, "%d failure(s)\n", failures);
    else std::printf("self test: ok\n");
    return failures ? 1 : 0;
}

int main(int argc, char **argv) {
    if (argc == 2 && std::strcmp(argv[1], "--self") == 0) return self_test();
    if (argc == 2) return run_cases(argv[1]);
    std::fprintf(stderr, "usage: %s CASES | --self\n", argv[0]);
    return 2;
}
