"""Prompt building for editors: FIM formats (fim.py), the code around the cursor and other open files."""

from .fim import FimFormat, FimPrompt, SuffixTrimmer, detect_fim, fim_prompt, prompt_budget, trim_to_suffix

__all__ = ["FimFormat", "FimPrompt", "SuffixTrimmer", "detect_fim", "fim_prompt", "prompt_budget", "trim_to_suffix"]
