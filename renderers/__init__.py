"""What a diagnosis looks like to a person: text for terminals, HTML for the report and the web page.

Pure functions from a :class:`diagnosis.Diagnosis` (and its :class:`diagnosis.JobData`) to strings;
the CLI and the API both use them.
"""
