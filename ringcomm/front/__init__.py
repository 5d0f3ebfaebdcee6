"""The front: torch's ProcessGroup methods, checked (``arguments``), made into
prepared calls (``requests``) on a lane (``lanes``), with their algorithm and
program (``plans``) and, under ``RINGCOMM_DEBUG=DETAIL``, compared across ranks
(``fingerprints``). ``process_group`` is the group torch sees."""
