"""Checkpoints that are never half-written.

Single files saved atomically (:mod:`pipepar.io`: written beside the target, flushed, then
renamed over it), checkpoint directories each rank writes its part of through
``torch.distributed.checkpoint`` (:func:`pipepar.distributed.save_checkpoint`), optimizer state
keyed by parameter name so a checkpoint loads into any balance, stage count or replica count,
and every process of a save learning whether another one failed.
"""
