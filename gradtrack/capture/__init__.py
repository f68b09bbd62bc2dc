"""The training thread's side: the probes on the model, each step's guard and verdict, its
batched reductions on the device, and the hand-off of what is due. Nothing here imports
the worker, the alert rules, delivery or the sinks (tests/test_structure.py)."""
