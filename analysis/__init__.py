"""Result files to the paper's figures and tables (``figures``, ``fig10``) and a report with the
speedup table (``report``); ``data`` reads the files. Reads result files only, never runs anything;
``strategies``, the cost model of many devices, computes its estimates and draws them."""
