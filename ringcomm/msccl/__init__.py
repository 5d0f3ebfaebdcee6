"""MSCCL's algorithms on ringcomm: import and export MSCCL's algorithm XML.

Research on collectives publishes algorithms as MSCCL XML (msccl-tools' MSCCLang,
synthesizers such as TACCL); MSCCL and RCCL run them on GPUs. Here such a file is
read, translated into ringcomm schedules (:mod:`ringcomm.msccl.translate`),
proven by ringcomm's checker before it runs, and then runs like any registered
algorithm: on CPU tensors over MPI, on CUDA tensors over NCCL, in the benchmark::

    import ringcomm
    name = ringcomm.register_msccl("allreduce_allpairs.xml")
    ringcomm.set_algorithm("allreduce", name)

and any registered schedule (ring, tree, the library's, a user's) is written out
as MSCCL XML with :func:`to_xml`. The format, as its writers emit it and its
runtimes read it, is in docs/msccl-format.md; what ringcomm accepts and refuses,
in docs/msccl.md.

Command line: ``python -m ringcomm.msccl check FILE.xml`` and
``python -m ringcomm.msccl export ring allreduce 8 > ring8.xml``.

The modules: :mod:`~ringcomm.msccl.algorithm` (:class:`Algorithm`, :func:`load`,
:func:`register`, :func:`to_xml`; ``ringcomm.msccl.algorithm.CACHE``, the
translations an algorithm keeps, is set there), :mod:`~ringcomm.msccl.xmlformat` (the XML as data,
:class:`StepType`), :mod:`~ringcomm.msccl.translate` (a program as every rank's
steps), :mod:`~ringcomm.msccl.export` (schedules as a program) and
``__main__`` (the command line). This package only hands their names on.
"""
from __future__ import annotations

from ringcomm.msccl import export, translate, xmlformat
from ringcomm.msccl.algorithm import Algorithm, load, register, to_xml
from ringcomm.msccl.xmlformat import COLLECTIVES, Program, StepType, parse, write

__all__ = ["Algorithm", "load", "register", "to_xml", "COLLECTIVES", "Program",
           "StepType", "parse", "write", "export", "translate", "xmlformat"]
