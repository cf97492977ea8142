"""kgen: a code-generating compiler for the sm_37 attention kernels.

Specs (``specs/*.kspec``) describe kernel variants; Jinja2 templates emit CUDA;
the build compiles it with the pinned CUDA 11.8 toolchain and ``kgen verify``
proves every generated kernel PTX- and SASS-identical to the golden.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    """``kgen.KVCache``, ``kgen.merge_attn_states``, ...: the public calls of
    kgen.runtime, imported on first use (the CLI never pays for them)."""
    if name.startswith("_"):
        raise AttributeError(f"module 'kgen' has no attribute {name!r}")
    import importlib
    import importlib.util

    if importlib.util.find_spec(f"kgen.{name}") is not None:  # a subpackage: itself
        return importlib.import_module(f"kgen.{name}")
    import kgen.runtime as runtime

    if name in runtime.__all__:
        value = globals()[name] = getattr(runtime, name)  # asked once
        return value
    raise AttributeError(f"module 'kgen' has no attribute {name!r}")


def __dir__():
    import kgen.runtime as runtime

    return sorted({*globals(), *runtime.__all__})
