"""The worker thread (`gradtrack.worker.thread`): it turns pending steps into records
(`gradtrack.worker.assemble`), runs the alert rules and their actions, and hands records and
alerts to delivery."""
