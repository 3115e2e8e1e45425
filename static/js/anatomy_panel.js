// A panel opened or closed: its name added to or removed from ?an_open=; app/tabs/anatomy/link.py panel_js.
() => { const q = new URLSearchParams(location.search);
  const open = new Set((q.has('an_open') ? q.get('an_open') : '__FIRST_OPEN__').split(',').filter(x => x)); open.__OP__('__PANEL__');
  q.set('an_open', [...open].join(','));  // empty: every panel closed
  history.replaceState(null, '', '?' + q.toString()); return []; }
