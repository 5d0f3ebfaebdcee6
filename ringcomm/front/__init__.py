"""The front: torch's ProcessGroup methods (``process_group``, the group torch
sees), their arguments checked (``arguments``) and made into prepared calls
(``reductions``, ``data_movement``; what they share: ``calls``) on a lane
(``lanes``), with their algorithm and program (``planner``) and, under
``RINGCOMM_DEBUG=DETAIL``, compared across ranks (``cross_rank_checks``)."""
