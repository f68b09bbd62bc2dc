"""Delivery: the outbox the worker hands records and alerts to and one courier thread per
sink behind it (``courier``), the run's durable spool on local disk (``spool``), and
``gradtrack sync`` for what a run left behind (``sync``)."""
