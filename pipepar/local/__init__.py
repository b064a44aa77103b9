"""Pipelines in one process: a worker thread per device, the stages running at once.

:func:`pipepar.wrap` builds a :class:`~pipepar.local.pipe.Pipe` (the one pipe class of this
runtime, for an ``nn.Sequential`` and any other model); :class:`~pipepar.local.gpipe.GPipe`
is the torchgpipe drop-in. The workers run a schedule's actions on their devices (CUDA or
CPU), hand activations and gradients to each other, drive the stages' backward when autograd
reaches the pipe, and share the CPU's math threads and cores among the stages.
"""
