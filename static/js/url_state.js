// The page's view state (model, prompt, Explore's controls) into the URL; app/server/page.py URL_JS.
(...v) => {
  const keys = __KEYS__;
  const q = new URLSearchParams(location.search);
  keys.forEach((k, i) => { let x = v[i]; if (typeof x === 'boolean') x = x ? 1 : 0;
                           if (x !== null && x !== undefined && x !== '') q.set(k, x); else q.delete(k); });
  history.replaceState(null, '', '?' + q.toString());
  return [];
}
