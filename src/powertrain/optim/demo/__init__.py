"""DeMo (Peng et al., arXiv 2411.19870) and FlexDeMo (From et al., arXiv 2502.06728).

- :mod:`.dct`: the math (chunked orthonormal DCT, top-k per chunk, decoding).
- :mod:`.optimizer`: :class:`DeMo`, one all-gather of packed values and compact indices per step.
- :mod:`.flex`: :class:`FlexDeMo`, FSDP2 inside a node group and DeMo across groups on a 2-D mesh.

Usage with DDP, as a diff against a plain training loop::

     model = DistributedDataParallel(model)
    +local_gradients(model)                     # powertrain.ddp: DeMo replaces the gradient all-reduce
    -opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    +opt = DeMo(model.parameters(), lr=1e-3)    # opt.comm.stats.bytes_sent: payload sent so far
"""

from powertrain.optim.demo.flex import FlexDeMo
from powertrain.optim.demo.optimizer import DeMo

__all__ = ["DeMo", "FlexDeMo"]
