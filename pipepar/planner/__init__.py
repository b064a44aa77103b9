"""Planning a split before any hardware: memory, time and the best layout.

From a :class:`~pipepar.Profile` (each layer's or unit's parameters, gradients, optimizer
state, activations kept for backward and time, measured on a device or on ``meta``):
:func:`pipepar.plan` splits the model exactly so every device fits and the slowest stage is
fastest, counting memory at every moment of the schedule; :func:`pipepar.search_layouts` ranks
whole layouts (pp x dp, sharded or replicated, schedule, micro-batches, recompute) by the step
time :func:`predict_step` gives for a cluster; :func:`fit_runtime` fits what a runtime adds
per action to steps you measured. The public names of this package are in ``__all__``.

    >>> from pipepar.planner import predict_step, measure_local
    >>> here = measure_local()
    >>> predict_step(prof, [4, 4], cluster=here, schedule="1f1b", chunks=8)  # doctest: +SKIP
"""

from pipepar.planner.calibrate import Measured, fit_runtime
from pipepar.planner.cluster import Cluster, Link, measure_local
from pipepar.planner.runtime_fit import RuntimeFit
from pipepar.planner.step_time import StageTime, StepPrediction, predict_step

__all__ = [
    "Cluster",
    "Link",
    "Measured",
    "RuntimeFit",
    "StageTime",
    "StepPrediction",
    "fit_runtime",
    "measure_local",
    "predict_step",
]
