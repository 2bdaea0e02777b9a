def display(*args, **kwargs):
    pass


class HTML(str):
    pass
