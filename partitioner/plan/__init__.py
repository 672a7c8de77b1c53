"""The Plan: cutting the graph into stage modules, choosing a schedule, predicting and rendering the step."""
