"""Applications on top of the library: the trade-off sweep, its tables and plots, the
Perceiver tables and attention maps, the DETR dense-vs-ENACT comparison and the figures
of the visualisers.

They import the library (``ops``, ``layers``, ``models``, ``patch``, ``engine``, ``bench``,
``data``, ``config``); nothing in the library imports them. The command-line wrappers in
:mod:`leanformer.commands` parse arguments, call them and print.
"""
