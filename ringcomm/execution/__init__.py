"""Schedules proved and run: the checker (``checker``, with NCCL's group rules in
``nccl_rules``), the programs that run a compiled schedule on a transport
(``executors``) and an NCCL-rules simulator for CI (``simulator``). The schedule
model is :mod:`ringcomm.schedule`; its builders are ``algorithms/`` and
``library/``."""
