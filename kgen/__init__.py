"""kgen: a code-generating compiler for the sm_37 attention kernels.

Specs (``specs/*.kspec``) describe kernel variants; Jinja2 templates emit CUDA;
the build compiles it with the pinned CUDA 11.8 toolchain and ``kgen verify``
proves every generated kernel PTX- and SASS-identical to the golden.
"""

__version__ = "0.1.0"
