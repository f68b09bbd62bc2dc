"""gradtrack's names in a W&B run, beyond the metric keys: histogram and picture families,
the profile chart, and the config entry that keeps the layer order for readers."""

from __future__ import annotations

HIST_FAMILY = "grad_hist"
PICTURES_FAMILY = "grad_pictures"  # summary images: grad_pictures/<name>
LAYERS_CONFIG_KEY = "gradtrack_layers"  # layer names in depth order, for readers
PROFILE_FAMILY = "grad_profile"
