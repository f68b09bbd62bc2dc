"""Delivery: the run's durable spool on local disk, one courier thread per sink, and
``gradtrack sync`` for what a run left behind."""
