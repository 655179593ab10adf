"""The offline autotuner: search, measurement, precompilation and the CLI
(``python -m flash_inductor.autotune``). It writes the tables that ``flash_inductor.tuning`` reads
at run time; nothing at run time imports it."""
