"""Recording what each stage did and when, as data: the events of a pipe's timeline.

``pipepar.wrap(..., trace=True)`` or ``with pipepar.tracing(pipe):`` records every wait,
transfer, forward, backward, weight gradient and recompute of every stage;
:class:`~pipepar.Timeline` reads them back (busy time, bubble, one timeline per mini-batch) and
:mod:`pipepar.timeline` draws them.
"""
