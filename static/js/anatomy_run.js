// The Show button: ?tab=anatomy&an_run=1; app/tabs/anatomy/link.py RUN_JS.
() => { const q = new URLSearchParams(location.search); q.set('tab', 'anatomy'); q.set('an_run', 1);
  history.replaceState(null, '', '?' + q.toString()); return []; }
