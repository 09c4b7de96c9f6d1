"""Result files to the paper's figures and tables (``figures``, ``fig10``) and a report with the
speedup table (``report``); ``data`` reads the files. Reads result files only, never runs anything;
``schemes``, the cost model of parallel training schemes on many devices, computes its estimates and
draws them. Imports nothing itself: a benchmark may take VGG-11 from ``schemes.network`` with torch
alone installed."""
