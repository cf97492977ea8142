// A C ABI over kgen's op-level entry points (generated/kgen_launch.hpp, kgen::ops), for
// tests that load it with ctypes: tests/toolchain/test_tc_cpp_ops.py (plans only, no
// GPU) and tests/gpu/test_cpp_launch.py (launches on the GPU). Built into one shared
// library with generated/kgen_launch.cpp:
//   g++ -std=c++17 -shared -fPIC -Igenerated -I<cuda include> kgen_ops_shim.cpp
//       generated/kgen_launch.cpp -o libkgen_ops_shim.so -ldl
//
// kgen_ops_call(request, run, stream, reply, reply_len): request is one line of
// tab-separated fields, op=<attention|paged_store|paged_attention|merge_attn_states|
// concat_and_cache_mla|gather_mla_cache|mla_decode_attention|mla_prefill_attention|
// dflash_block_attention|dflash_paged_block_attention|choose|mla_default_splits> then
// <name>=T:<ptr>:<d0>,<d1>..[:<s0>,<s1>..] (a device array: address, shape and, if
// given, element strides), <name>=I:<int>, <name>=F:<float>, <name>=S:<text>. With
// run = 0 it plans (every check, nothing launched) and writes to reply
//   OK\t<kps>\t<splits_cap>\t<plan source>, then a line a launch:
//   <kernel>\t<gx>,<gy>,<gz>\t<bx>,<by>,<bz>\t<smem>\t<fill_pos>:<pos>\t<neutral sinks>
//   then \t and each parameter in order: T:<ptr>:<dims> | I:<int> | F:<float32 value>
// or ERR\t<code>\t<contract>\t<message>; with run = 1 it launches on the CUstream
// `stream` and writes OK or ERR. op=choose (fields role, kv, head_dim, groups, needs
// as axis=value,axis=value, where ring_rows/sink_rows/tile_keys, variant) writes
// OK\t<kernel> or ERR; op=slot_attention takes SlotAttentionArgs' fields (positions as
// p0,p1,..; slot for a prefill), its launch lines <fill_pos>:<pos>[:<v0>,<v1>..] (the
// positions a step writes first); op=mla_default_splits (max_seq_len, sm_count) writes the count.
// The other ops' fields are their Args' members by name (MlaDecodeArgs::variants:
// variant_decode, variant_combine). Returns the Result's code.
#include "kgen_launch.hpp"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace {

std::vector<std::string> split(const std::string &s, char sep) {
    std::vector<std::string> out;
    std::string cur;
    std::istringstream in(s);
    while (std::getline(in, cur, sep)) out.push_back(cur);
    return out;
}

struct Request {
    std::map<std::string, std::string> v;
    std::map<std::string, std::string> kind;

    bool has(const char *n) const { return v.count(n) != 0; }
    kgen::Tensor t(const char *n) const {
        kgen::Tensor out;
        auto it = v.find(n);
        if (it == v.end() || kind.at(n) != "T") return out;
        std::vector<std::string> parts = split(it->second, ':');
        std::vector<std::int64_t> dims;
        if (parts.size() > 1 && !parts[1].empty())
            for (const std::string &d : split(parts[1], ',')) dims.push_back(std::atoll(d.c_str()));
        out.ptr = (CUdeviceptr)std::strtoull(parts[0].c_str(), nullptr, 10);
        out.ndim = 0;
        for (std::int64_t d : dims) {
            if (out.ndim < 4) out.shape[out.ndim] = d;
            ++out.ndim;
        }
        if (parts.size() > 2) {
            int i = 0;
            for (const std::string &s : split(parts[2], ','))
                if (i < 4) out.strides[i++] = std::atoll(s.c_str());
            out.has_strides = true;
        }
        return out;
    }
    std::int64_t i(const char *n, std::int64_t dflt = 0) const {
        auto it = v.find(n);
        return it == v.end() ? dflt : std::atoll(it->second.c_str());
    }
    std::optional<std::int64_t> oi(const char *n) const {
        if (!has(n)) return std::nullopt;
        return i(n);
    }
    double f(const char *n, double dflt = 0) const {
        auto it = v.find(n);
        return it == v.end() ? dflt : std::strtod(it->second.c_str(), nullptr);
    }
    const char *s(const char *n) const {
        auto it = v.find(n);
        return it == v.end() ? nullptr : it->second.c_str();
    }
};

kgen::ops::Options options(const Request &r) {
    kgen::ops::Options o;
    if (r.has("scale")) o.scale = r.f("scale");
    o.causal = r.i("causal", 1) != 0;
    if (r.has("window_left"))
        o.window_size = kgen::ops::Window{r.i("window_left"), r.i("window_right")};
    o.logits_soft_cap = r.f("logits_soft_cap");
    o.sinks = r.t("sinks");
    o.attn_sink = r.i("attn_sink");
    o.attn_win = r.i("attn_win");
    return o;
}

std::string tensor_text(const kgen::Tensor &t) {
    std::ostringstream o;
    o << "T:" << (unsigned long long)t.ptr << ":";
    for (int i = 0; i < t.ndim && i < 4; ++i) o << (i ? "," : "") << t.shape[i];
    return o.str();
}

std::string error_text(const kgen::Result &r) {
    std::ostringstream o;
    o << "ERR\t" << r.code << "\t" << r.contract << "\t" << r.message;
    return o.str();
}

std::string plan_text(const kgen::ops::Plan &p) {
    std::ostringstream o;
    o << "OK\t" << p.kps << "\t" << p.splits_cap << "\t" << p.plan_source;
    for (const kgen::ops::Step &s : p.steps) {
        const kgen::Launch &l = s.launch;
        o << "\n" << kgen::kernel_name(*s.kernel) << "\t" << l.grid[0] << "," << l.grid[1] << ","
          << l.grid[2] << "\t" << l.block[0] << "," << l.block[1] << "," << l.block[2] << "\t"
          << l.shared_bytes << "\t" << (s.fill_pos ? 1 : 0) << ":" << s.pos_value;
        for (std::size_t i = 0; i < s.fill_values.size(); ++i) o << (i ? "," : ":") << s.fill_values[i];
        o << "\t"
          << (s.neutral_sinks ? 1 : 0);
        std::vector<kgen::ops::BoundParam> ps;
        kgen::Result r = kgen::ops::bound_params(*s.kernel, s.args, &ps);
        if (!r) return error_text(r);
        for (const kgen::ops::BoundParam &b : ps) {
            o << "\t";
            if (b.kind == 0) {
                o << tensor_text(b.tensor);
            } else if (b.kind == 1) {
                o << "I:" << b.i;
            } else {
                char buf[64];
                std::snprintf(buf, sizeof buf, "F:%.9g", (double)(float)b.f);
                o << buf;
            }
        }
    }
    return o.str();
}

std::string call(const Request &r, int run, CUstream stream, int *code) {
    std::string op = r.s("op") ? r.s("op") : "";
    kgen::ops::Plan plan;
    kgen::Result res;
    if (op == "choose") {
        std::vector<kgen::ops::Need> needs;
        std::vector<std::string> pairs;
        if (r.s("needs") && *r.s("needs")) pairs = split(r.s("needs"), ',');
        std::vector<std::string> keep;  // the Need strings' storage
        keep.reserve(pairs.size() * 2);
        for (const std::string &p : pairs) {
            std::size_t eq = p.find('=');
            keep.push_back(p.substr(0, eq));
            keep.push_back(p.substr(eq + 1));
        }
        for (std::size_t i = 0; i + 1 < keep.size(); i += 2)
            needs.push_back({keep[i].c_str(), keep[i + 1].c_str()});
        kgen::ops::Where w;
        w.ring_rows = r.i("ring_rows", -1);
        w.sink_rows = r.i("sink_rows", -1);
        w.tile_keys = r.i("tile_keys", -1);
        int role = -1;
        for (int i = 0; i < kgen::ops::R_COUNT; ++i)
            if (std::strcmp(kgen::ops::role_name((kgen::ops::Role)i), r.s("role") ? r.s("role") : "") == 0)
                role = i;
        const kgen::KernelInfo *k = nullptr;
        res = kgen::ops::choose((kgen::ops::Role)role, r.s("kv"), r.i("head_dim"), r.i("groups", 1),
                                needs.data(), (int)needs.size(), &k, w, r.s("variant"));
        *code = res.code;
        return res ? std::string("OK\t") + kgen::kernel_name(*k) : error_text(res);
    }
    if (op == "attention") {
        kgen::ops::AttentionArgs a;
        kgen::ops::DenseCache &c = a.cache;
        if (r.s("kv")) c.kv = r.s("kv");
        c.n_head_kv = r.i("n_head_kv");
        c.head_dim = r.i("head_dim");
        c.max_seq = r.i("max_seq");
        c.k = r.t("k");
        c.v = r.t("v");
        c.k_sink = r.t("k_sink");
        c.v_sink = r.t("v_sink");
        c.k_win = r.t("k_win");
        c.v_win = r.t("v_win");
        c.sink = r.i("sink");
        c.win = r.i("win");
        c.k_scale = r.f("k_scale", 1.0);
        c.v_scale = r.f("v_scale", 1.0);
        a.q = r.t("q");
        a.k_new = r.t("k_new");
        a.v_new = r.t("v_new");
        a.out = r.t("out");
        a.pos = r.i("pos");
        a.options = options(r);
        a.kps = r.oi("kps");
        a.splits_cap = r.oi("splits_cap");
        a.m = r.t("m");
        a.l = r.t("l");
        a.acc = r.t("acc");
        a.pos_dev = r.t("pos_dev");
        a.tune_store = r.s("tune_store");
        a.sm_count = r.i("sm_count");
        a.prefill_variant = r.s("prefill_variant");
        res = run ? kgen::ops::attention(a, stream) : kgen::ops::plan_attention(a, &plan);
    } else if (op == "paged_store" || op == "paged_attention") {
        kgen::ops::PagedCache c;
        if (r.s("kv")) c.kv = r.s("kv");
        c.n_head_kv = r.i("n_head_kv");
        c.head_dim = r.i("head_dim");
        c.key_cache = r.t("key_cache");
        c.value_cache = r.t("value_cache");
        c.k_scale = r.f("k_scale", 1.0);
        c.v_scale = r.f("v_scale", 1.0);
        if (op == "paged_store") {
            kgen::ops::PagedStoreArgs a;
            a.cache = c;
            a.key = r.t("key");
            a.value = r.t("value");
            a.slot_mapping = r.t("slot_mapping");
            res = run ? kgen::ops::paged_store(a, stream) : kgen::ops::plan_paged_store(a, &plan);
        } else {
            kgen::ops::PagedAttentionArgs a;
            a.cache = c;
            a.q = r.t("q");
            a.out = r.t("out");
            a.block_table = r.t("block_table");
            a.seq_lens = r.t("seq_lens");
            a.query_start_loc = r.t("query_start_loc");
            a.max_query_len = r.i("max_query_len");
            a.max_seq_len = r.i("max_seq_len");
            a.options = options(r);
            a.kps = r.oi("kps");
            a.splits_cap = r.oi("splits_cap");
            a.m = r.t("m");
            a.l = r.t("l");
            a.acc = r.t("acc");
            a.sm_count = r.i("sm_count");
            res = run ? kgen::ops::paged_attention(a, stream)
                      : kgen::ops::plan_paged_attention(a, &plan);
        }
    } else if (op == "slot_attention") {
        kgen::ops::SlotAttentionArgs a;
        kgen::ops::SlotCache &c = a.cache;
        if (r.s("kv")) c.kv = r.s("kv");
        c.nslots = r.i("nslots");
        c.n_head_kv = r.i("n_head_kv");
        c.head_dim = r.i("head_dim");
        c.max_seq = r.i("max_seq");
        c.k = r.t("k");
        c.v = r.t("v");
        c.k_sink = r.t("k_sink");
        c.v_sink = r.t("v_sink");
        c.k_win = r.t("k_win");
        c.v_win = r.t("v_win");
        c.sink = r.i("sink");
        c.win = r.i("win");
        c.k_scale = r.f("k_scale", 1.0);
        c.v_scale = r.f("v_scale", 1.0);
        a.slot = r.oi("slot");
        a.q = r.t("q");
        a.k_new = r.t("k_new");
        a.v_new = r.t("v_new");
        a.out = r.t("out");
        a.pos = r.i("pos");
        if (r.s("positions") && *r.s("positions"))
            for (const std::string &p : split(r.s("positions"), ',')) a.positions.push_back(std::atoll(p.c_str()));
        a.options = options(r);
        a.kps = r.oi("kps");
        a.splits_cap = r.oi("splits_cap");
        a.m = r.t("m");
        a.l = r.t("l");
        a.acc = r.t("acc");
        a.pos_dev = r.t("pos_dev");
        a.sm_count = r.i("sm_count");
        res = run ? kgen::ops::slot_attention(a, stream) : kgen::ops::plan_slot_attention(a, &plan);
    } else if (op == "merge_attn_states") {
        kgen::ops::MergeAttnStatesArgs a;
        a.output = r.t("output");
        a.output_lse = r.t("output_lse");
        a.prefix_output = r.t("prefix_output");
        a.prefix_lse = r.t("prefix_lse");
        a.suffix_output = r.t("suffix_output");
        a.suffix_lse = r.t("suffix_lse");
        if (r.has("prefill_tokens_with_context"))
            a.prefill_tokens_with_context = r.i("prefill_tokens_with_context");
        if (r.s("in_dtype")) a.in_dtype = r.s("in_dtype");
        if (r.s("out_dtype")) a.out_dtype = r.s("out_dtype");
        a.variant = r.s("variant");
        res = run ? kgen::ops::merge_attn_states(a, stream)
                  : kgen::ops::plan_merge_attn_states(a, &plan);
    } else if (op == "concat_and_cache_mla") {
        kgen::ops::ConcatAndCacheMlaArgs a;
        a.kv_c = r.t("kv_c");
        a.k_pe = r.t("k_pe");
        a.kv_cache = r.t("kv_cache");
        a.slot_mapping = r.t("slot_mapping");
        if (r.s("in_dtype")) a.in_dtype = r.s("in_dtype");
        a.variant = r.s("variant");
        res = run ? kgen::ops::concat_and_cache_mla(a, stream)
                  : kgen::ops::plan_concat_and_cache_mla(a, &plan);
    } else if (op == "gather_mla_cache") {
        kgen::ops::GatherMlaCacheArgs a;
        a.dst = r.t("dst");
        a.src_cache = r.t("src_cache");
        a.block_table = r.t("block_table");
        a.cu_seq_lens = r.t("cu_seq_lens");
        a.token_to_seq = r.t("token_to_seq");
        a.seq_starts = r.t("seq_starts");
        a.num_tokens = r.i("num_tokens");
        if (r.s("in_dtype")) a.in_dtype = r.s("in_dtype");
        a.variant = r.s("variant");
        res = run ? kgen::ops::gather_mla_cache(a, stream)
                  : kgen::ops::plan_gather_mla_cache(a, &plan);
    } else if (op == "mla_decode_attention") {
        kgen::ops::MlaDecodeArgs a;
        a.out = r.t("out");
        a.lse = r.t("lse");
        a.query = r.t("query");
        a.kv_cache = r.t("kv_cache");
        a.block_table = r.t("block_table");
        a.seq_lens = r.t("seq_lens");
        if (r.has("scale")) a.scale = r.f("scale");
        if (r.has("num_kv_splits")) a.num_kv_splits = r.i("num_kv_splits");
        a.max_seq_len = r.oi("max_seq_len");
        a.m = r.t("m");
        a.l = r.t("l");
        a.acc = r.t("acc");
        a.sm_count = r.i("sm_count");
        if (r.s("in_dtype")) a.in_dtype = r.s("in_dtype");
        if (r.s("out_dtype")) a.out_dtype = r.s("out_dtype");
        a.variants[0] = r.s("variant_decode");
        a.variants[1] = r.s("variant_combine");
        res = run ? kgen::ops::mla_decode_attention(a, stream)
                  : kgen::ops::plan_mla_decode_attention(a, &plan);
    } else if (op == "mla_prefill_attention") {
        kgen::ops::MlaPrefillArgs a;
        a.out = r.t("out");
        a.lse = r.t("lse");
        a.query = r.t("query");
        a.key = r.t("key");
        a.value = r.t("value");
        a.cu_seqlens_q = r.t("cu_seqlens_q");
        a.cu_seqlens_k = r.t("cu_seqlens_k");
        if (r.has("scale")) a.scale = r.f("scale");
        a.causal = r.i("causal", 1) != 0;
        a.max_seqlen_q = r.i("max_seqlen_q");
        a.max_seqlen_k = r.oi("max_seqlen_k");
        if (r.s("in_dtype")) a.in_dtype = r.s("in_dtype");
        if (r.s("out_dtype")) a.out_dtype = r.s("out_dtype");
        a.variant = r.s("variant");
        res = run ? kgen::ops::mla_prefill_attention(a, stream)
                  : kgen::ops::plan_mla_prefill_attention(a, &plan);
    } else if (op == "dflash_block_attention" || op == "dflash_paged_block_attention") {
        const bool paged = op == "dflash_paged_block_attention";
        kgen::ops::DFlashArgs d;
        kgen::ops::DFlashPagedArgs g;
        std::optional<double> scale;
        if (r.has("scale")) scale = r.f("scale");
        const bool causal = r.i("causal", d.causal ? 1 : 0) != 0;
        const std::int64_t window = r.i("sliding_window", d.sliding_window);
        if (!paged) {
            d.out = r.t("out");
            d.query = r.t("query");
            d.key = r.t("key");
            d.value = r.t("value");
            d.cu_seqlens = r.t("cu_seqlens");
            d.scale = scale;
            d.causal = causal;
            d.sliding_window = window;
            d.num_reqs = r.oi("num_reqs");
            if (r.s("in_dtype")) d.in_dtype = r.s("in_dtype");
            if (r.s("out_dtype")) d.out_dtype = r.s("out_dtype");
            d.variant = r.s("variant");
            res = run ? kgen::ops::dflash_block_attention(d, stream)
                      : kgen::ops::plan_dflash_block_attention(d, &plan);
        } else {
            g.out = r.t("out");
            g.query = r.t("query");
            g.block_key = r.t("block_key");
            g.block_value = r.t("block_value");
            g.ctx_key = r.t("ctx_key");
            g.ctx_value = r.t("ctx_value");
            g.cu_seqlens = r.t("cu_seqlens");
            g.seq_lens = r.t("seq_lens");
            g.block_table = r.t("block_table");
            g.scale = scale;
            g.causal = causal;
            g.sliding_window = window;
            g.num_reqs = r.oi("num_reqs");
            g.block_size = r.oi("block_size");
            if (r.s("in_dtype")) g.in_dtype = r.s("in_dtype");
            if (r.s("out_dtype")) g.out_dtype = r.s("out_dtype");
            g.variant = r.s("variant");
            res = run ? kgen::ops::dflash_paged_block_attention(g, stream)
                      : kgen::ops::plan_dflash_paged_block_attention(g, &plan);
        }
    } else if (op == "mla_default_splits") {
        *code = 0;
        return std::to_string(kgen::ops::mla_default_splits(r.i("max_seq_len"), r.i("sm_count")));
    } else {
        res.code = kgen::KGEN_ERR_UNKNOWN;
        res.message = "unknown op " + op;
    }
    *code = res.code;
    if (!res) return error_text(res);
    return run ? std::string("OK") : plan_text(plan);
}

}  // namespace

extern "C" int kgen_ops_call(const char *request, int run, void *stream, char *reply,
                             int reply_len) {
    Request r;
    for (const std::string &part : split(request, '\t')) {
        std::size_t eq = part.find('=');
        if (eq == std::string::npos || part.size() < eq + 3) continue;
        std::string name = part.substr(0, eq);
        r.kind[name] = part.substr(eq + 1, 1);
        r.v[name] = part.substr(eq + 3);
    }
    int code = 0;
    std::string out = call(r, run, (CUstream)stream, &code);
    if (reply && reply_len > 0) {
        std::size_t n = out.size() < (std::size_t)reply_len - 1 ? out.size() : (std::size_t)reply_len - 1;
        std::memcpy(reply, out.data(), n);
        reply[n] = '\0';
    }
    return (int)out.size() >= reply_len ? -1 - (int)out.size() : code;
}

// Where the fatbins are read from (kgen::set_generated_dir).
extern "C" void kgen_ops_set_generated_dir(const char *dir) { kgen::set_generated_dir(dir); }

// Read the tune stores again at the next lookup (kgen::ops::forget_tune_stores).
extern "C" void kgen_ops_forget_tune_stores() { kgen::ops::forget_tune_stores(); }
