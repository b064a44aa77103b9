"""What a pipeline across processes runs on each rank and between ranks, shared by both computes
of :class:`~pipepar.distributed.pipe.DistributedPipe` (a chain of layers for ``nn.Sequential``,
the model's own forward for any model); users reach them through :mod:`pipepar.distributed`.

Modules: :mod:`~pipepar.ranks.process` (the process group, this rank's device),
:mod:`~pipepar.ranks.mesh` (the pp x dp grid of ranks),
:mod:`~pipepar.ranks.transport` (point-to-point activations and gradients),
:mod:`~pipepar.ranks.runtime` (running a schedule), :mod:`~pipepar.ranks.replicas`
(dp sync), :mod:`~pipepar.ranks.sharding` (dp sharded with FSDP2, ``dp_shard=True``),
:mod:`~pipepar.ranks.clipping` (the gradient norm over every rank),
:mod:`~pipepar.ranks.arguments` (one rank's arguments checked alone),
:mod:`~pipepar.ranks.handshake` (every rank passed the same ones, checked at wrap time),
:mod:`~pipepar.ranks.failure` (fault reporting), :mod:`~pipepar.ranks.progress`
(what each rank runs and waits for; every wait bounded by ``timeout``) and
:mod:`~pipepar.ranks.guard` (a step's failure or stall ends every rank).
"""
