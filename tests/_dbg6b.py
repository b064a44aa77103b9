import sys, time
sys.path[:0] = ["tests", "."]
import torch
from torch import nn
import pipepar.distributed as ppd
from test_distributed import Pool, batches
import test_distributed_faults as T

def case(rank):
    x, y = batches(2, 1)[0]
    t = time.monotonic()
    r = T._changing_stage(rank, lambda t: t[:, :-1], x, y)
    return rank, round(time.monotonic() - t, 2), r[:250]

if __name__ == "__main__":
    p = Pool()
    for r in p.run(case, timeout=120): print(r)
    p.close()
