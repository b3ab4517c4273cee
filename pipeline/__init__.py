"""gradcomp.pipeline: pipeline-parallel training over compressed point-to-point links.

``Pipeline`` (``pipe.py``) runs one rank's stage under a schedule (``schedule.py``: GPipe,
1F1B, interleaved 1F1B, ZB-H1 with each backward split into input and weight passes,
``backward.py``) with each boundary direction through a boundary compressor, AQ-SGD's delta
mode as an option (``delta.py``), data parallelism across stage replicas on a 2-D rank grid
(``grid.py``), recompute inside stages, and ``balance="auto"`` (``balance.py``: a
dynamic programme over measured layer time and compressed boundary bytes). See docs/pipeline.md.
"""
from .balance import Balance, LayerCost, auto_balance, measure_layers, partition
from .delta import DeltaFeedback
from .pipe import CHECKPOINTS, Event, Pipeline
from .schedule import PASSES, SCHEDULES, Action, Simulation, build, ideal_bubble, simulate

__all__ = ["Pipeline", "Event", "CHECKPOINTS", "SCHEDULES", "PASSES", "Action", "build", "simulate", "Simulation",
           "ideal_bubble", "auto_balance", "measure_layers", "partition", "Balance", "LayerCost", "DeltaFeedback"]
