"""The cockpit: what a researcher reads of runs and sweeps. Run reports and the metric panel (`reports`,
`metric_panel`, `plots`, `blend_report`), sweeps and their search (`sweep`, `sweep_search`, `sweep_live`) and the
MLflow records (`tracking`). It reads the lake and the specs; nothing below it (core, data, lake) imports it.
The statistics it shows (`factory.intervals`, `factory.numbers`) stay leaves at the root: the lake uses them too."""
