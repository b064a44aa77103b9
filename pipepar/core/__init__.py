"""What a pipeline computes, with torch alone: no threads, no process groups.

Both runtimes (one process, :mod:`pipepar.local`; many, :mod:`pipepar.distributed`) and both
computes (a chain of layers, an ``nn.Sequential``; any model's own forward,
:mod:`pipepar.program`) use these pieces unchanged:

- schedules as data (:class:`~pipepar.core.schedule.Schedule`: each worker's ordered F, B and
  W actions, built, validated, printed and simulated);
- the step: one stage's forward, backward or its B and W halves on one micro-batch, recompute
  with the random draws replayed, the sums of each micro-batch's weight gradients;
- micro-batches: a batch cut into them and outputs joined back, losses joined by shares
  learned from the loss's own operations, micro-batches the caller made;
- the probe that finds what micro-batching would change (rows mixed, a loss that cannot be
  joined, packed documents that see each other) and refuses it before any gradient;
- deferred batch norm, compiled units, the ``PIPEPAR_*`` switches.

Users reach them through :func:`pipepar.wrap` and :mod:`pipepar.distributed`; the public names
among them are re-exported by :mod:`pipepar` (``Schedule``, ``BatchCoupled``,
``LossNotJoinable``, ``sequentialize``).
"""
