// The chosen tab into the URL (?tab=); app/server/page.py tab_url_js.
() => { const q = new URLSearchParams(location.search); q.set('tab', '__TAB__');
                       history.replaceState(null, '', '?' + q.toString()); return []; }
