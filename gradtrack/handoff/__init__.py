"""What the training thread and the worker agree on: the mailbox between them and what rides
in it (the pending step, its update, the worker's reply, the drop count: ``mailbox``), the
layout of a step's host copy and its evidence (``layout``), and the per-step rules' checks
(``rules``)."""
