"""What a replay tells its reader: report.json / report.md / report.html, triage across tiers, repro bundles."""
