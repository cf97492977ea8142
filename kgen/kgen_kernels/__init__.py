"""kgen_kernels: one launcher per kernel kgen built, made from the build's manifest.

``from kgen_kernels import fc_attn_flash_prefill`` (a kernel) or ``from kgen_kernels
import attn_prefill`` (a module). The artifacts are found by kgen.runtime.kernels:
``KGEN_GENERATED``, then this package's own directory (an installed wheel), then the
checkout's ``generated/``; with none, this import says what to run. This file is the
package's only source; a wheel puts the manifest and the fatbins beside it.
"""

from pathlib import Path

from kgen.runtime.kernels import expose

expose(globals(), Path(__file__).parent)
