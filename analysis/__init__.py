"""Result files to the paper's tables and figures (to come); reads result files only."""
