"""Delivery: the outbox the worker hands records and alerts to (``outbox``), the run's durable
spool on local disk (``spool``), one courier thread per sink (``courier``), and
``gradtrack sync`` for what a run left behind (``sync``)."""
