"""Tables, figures and a self-contained HTML report from a sweep folder."""
