"""The worker thread (`gradtrack.worker.thread`): it turns pending steps into records
(`gradtrack.worker.assemble`), runs the alert rules and their actions, keeps the flight
recorder's window (`gradtrack.worker.flight_log`) and the noise scale
(`gradtrack.worker.noise_scale`), and hands records and alerts to delivery's outbox."""
