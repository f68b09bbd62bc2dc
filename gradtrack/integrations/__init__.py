"""Callbacks for training frameworks. Each module imports its framework only when imported:

* `gradtrack.integrations.lightning.GradtrackCallback` — Lightning (``pip install
  gradtrack[lightning]``);
* `gradtrack.integrations.transformers.GradtrackCallback` — the Hugging Face ``Trainer``
  (``pip install gradtrack[transformers]``).
"""
