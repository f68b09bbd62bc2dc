"""What the training thread and the worker agree on: the mailbox between them, a step's
evidence and the layout of its host copy, the pending step, and the drop counts."""
