"""How a job starts: launchers, MPI worlds and communicators (``bootstrap``) and
the network path across hosts (``network``)."""
