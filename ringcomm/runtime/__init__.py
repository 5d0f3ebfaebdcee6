"""What runs a prepared call: the CPU lane's engine (``engine``: the caller's
thread when idle, else a progress thread), the CUDA lane's stream engine
(``streams``) and the Work handles both return (``work``)."""
