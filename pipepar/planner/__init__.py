"""planner"""

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
