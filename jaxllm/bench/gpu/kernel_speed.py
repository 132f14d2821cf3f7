"""stub"""


def run(ctx):
    pass
