// The link's ?tab= as the page read it in <head> (opened_tab_head.js): the first input of the link loaders of Generate, Interventions and Anatomy.
() => [window.lmscopeOpenTab || '']
