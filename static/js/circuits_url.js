// The attribution graph's set, target, thresholds and view (supernodes, pins) into the URL, so a
// link reproduces the graph as drawn; app/tabs/explore/circuits_panel.py URL_JS, circuits_view.py.
(...v) => {
  const keys = __KEYS__;
  const q = new URLSearchParams(location.search);
  if (!v[0]) { keys.forEach((k) => q.delete(k)); }
  else {
    keys.forEach((k, i) => { const x = v[i];
      if (x !== null && x !== undefined && x !== '') q.set(k, x); else q.delete(k); });
    try { const view = JSON.parse(v[4] || '{}');
      if (!Object.keys(view.groups || {}).length && !(view.pins || []).length) q.delete('cview');
    } catch (e) { q.delete('cview'); }
  }
  history.replaceState(null, '', '?' + q.toString());
  return [];
}
