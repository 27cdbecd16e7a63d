"""The workers and the demos: algorithms, worker loss, a run killed whole that resumes."""
