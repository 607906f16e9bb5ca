"""The load generator: healthy, slow and stalled streaming clients against an OpenAI API.

report = await run_load(LoadPlan(url="http://127.0.0.1:8000", healthy=8, stalled=2))
"""

from kvwatch.lab.loadgen.report import ClassReport, LoadReport, Percentiles, render_text
from kvwatch.lab.loadgen.runner import LoadPlan, run_load

__all__ = ["ClassReport", "LoadPlan", "LoadReport", "Percentiles", "render_text", "run_load"]
