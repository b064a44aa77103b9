"""Drawing what other packages record: plans, profiles and timelines as text, HTML and images.

Reads data only (a :class:`~pipepar.Plan`, a :class:`~pipepar.Timeline`, a layout search's
results) and never runs a pipe; nothing else in pipepar draws. Users reach it through
:mod:`pipepar.report` (a plan as a terminal table or an HTML page) and :mod:`pipepar.timeline`
(a run's timeline as SVG, PNG, HTML or a Chrome trace).
"""
