"""bench/train_task.py with OnebitLamb's sketch on its drawn int32 index (``sketch_hash = 0``, as a run
resumed from a checkpoint of the release before the hashed index): the control of run.py."""

import os
import runpy
import sys

from onebit.optimizers import onebit_lamb

_init = onebit_lamb.OnebitLamb.__init__


def _drawn(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.sketch_hash = 0


onebit_lamb.OnebitLamb.__init__ = _drawn
BENCH = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TASK = os.path.join(BENCH, "train_task.py")
sys.argv[0] = TASK
sys.path.insert(0, os.path.dirname(TASK))
runpy.run_path(TASK, run_name="__main__")
