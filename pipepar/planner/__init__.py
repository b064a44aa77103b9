"""planner"""

from pipepar.planner.cluster import Cluster, Link, measure_local
from pipepar.planner.step_time import StageTime, StepPrediction, predict_step

__all__ = ["Cluster", "Link", "StageTime", "StepPrediction", "measure_local", "predict_step"]
