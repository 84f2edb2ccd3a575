"""`codespec bench`: speed measured side by side in one process, as ratios, medians of repeats."""
