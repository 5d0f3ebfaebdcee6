"""How a job starts: which launcher started it (``launchers``), MPI worlds and
communicators (``bootstrap``), Slurm's variables (``slurm``) and the network
path across hosts (``network``)."""
