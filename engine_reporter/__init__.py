"""What an engine embeds to publish its events: ``Reporter`` (shell) around ``ReportBuilder``."""

from engine_reporter.builder import ReportBuilder
from engine_reporter.reporter import Reporter, ReporterStats, new_epoch

__all__ = ["ReportBuilder", "Reporter", "ReporterStats", "new_epoch"]
